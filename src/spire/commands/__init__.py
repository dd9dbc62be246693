"""CLI glue: what the ``spire`` subcommands do between parsing their options (:mod:`spire.cli`) and the
library. One module per command; library modules never import from here, and nothing here imports spire.cli.

Modules that import torch when loaded hold a command's arguments and its run function; spire.cli declares their
options:

- :mod:`spire.commands.throughput`: ``spire throughput`` (grid options -> cost-model rows, table / JSON / CSV).
- :mod:`spire.commands.tau`: ``spire tau`` (τ of several drafts, L and temperatures; its JSON file).
- :mod:`spire.commands.train`: ``spire train`` (target, text, TrainConfig, the run's summary).
- :mod:`spire.commands.bench`: ``spire bench`` and ``spire bench calibrate``.

Light modules (the library imported inside their functions) hold the whole command, options included, and
spire.cli registers it:

- :mod:`spire.commands.throughput_figures`: ``spire throughput-figures``.
- :mod:`spire.commands.reproduce`: ``spire reproduce`` (options -> ReproduceConfig, the main job).
- :mod:`spire.commands.data`: ``spire data``.
- :mod:`spire.commands.generate`: ``spire generate`` (prompts, chat template, weight formats, text / JSON out).
- :mod:`spire.commands.export`: ``spire export``.
- :mod:`spire.commands.compare`: ``spire compare``.

:mod:`spire.commands.options` parses what several commands share (grids, ``KEY=VALUE`` lists, the options a
user set, draft kinds).
"""
