"""CLI glue: what the ``spire`` subcommands do between parsing their options (:mod:`spire.cli`) and the
library. Each module holds one command's arguments dataclass and its run function; library modules never
import from here.

- :mod:`spire.commands.throughput`: ``spire throughput`` (grid options -> cost-model rows, table / JSON / CSV).
- :mod:`spire.commands.tau`: ``spire tau`` (τ of several drafts, L and temperatures; its JSON file).
- :mod:`spire.commands.train`: ``spire train`` (target, text, TrainConfig, the run's summary).
- :mod:`spire.commands.bench`: ``spire bench`` and ``spire bench calibrate``.
"""
