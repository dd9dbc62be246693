"""The decoding engine: continuous batching with lossless speculative decoding, in three parts.

- :mod:`spire.engine.scheduler` (pure Python, no torch): the queue, the slots, aborts and the prefill budget; each
  step it returns a :class:`~spire.engine.scheduler.StepPlan`.
- :mod:`spire.engine.runner`: executes a plan on the target and the draft: prefill pieces, KV copies, one round
  (draft k tokens, verify k + 1 positions, accept a prefix per row) and the rollback.
- :mod:`spire.engine.engine`: :class:`~spire.engine.engine.Engine` joins them: plan, run, commit.

Below them: :mod:`spire.engine.prefill` (a batch's prefill, the cache length, starting a draft) and
:mod:`spire.engine.output` (cutting a request's tokens, torch-free). ``spire serve`` (:mod:`spire.serving`),
``spire tau`` / ``spire compare`` (:mod:`spire.evaluation`) and ``spire bench`` (:mod:`spire.bench`) all decode
here. This package's ``__init__`` imports nothing, so the scheduler stays importable without torch.
"""
