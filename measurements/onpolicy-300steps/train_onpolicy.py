"""`spire train` with each training window replaced by its on-policy version from gen.py (looked up by the
natural window's tokens); the data key gets a suffix, so the target cache is built for these windows.

    python train_onpolicy.py onpolicy_300_64.pt train --draft spire ... (the arguments of `spire train`)
"""
import sys

import torch

import spire.commands.train as train_command

blob = torch.load(sys.argv.pop(1))
table = {r.numpy().astype("int64").tobytes(): g for r, g in zip(blob["natural"], blob["generated"])}
natural_load = train_command.load_data


def load_data(spec, tokenizer, progress):
    data = natural_load(spec, tokenizer, progress)
    data.manifest = {**data.manifest, "key": f"{data.manifest['key']}-onpolicy{blob['G']}-{blob['steps']}"}
    natural_batch = data.sample_train_batch

    def sample(batch_size, seq_len, generator=None):
        nat = natural_batch(batch_size, seq_len, generator)
        return torch.stack([table[r.numpy().astype("int64").tobytes()] for r in nat])  # KeyError past STEPS

    data.sample_train_batch = sample
    return data


train_command.load_data = load_data
from spire.cli import main  # noqa: E402

sys.exit(main())
