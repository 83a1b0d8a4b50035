"""Evaluation of a drafter against its target (``dflash eval``, and the trainer's held-out
measurement): :mod:`~dflash.evaluation.decoding` (target-only and speculative decoding),
:mod:`~dflash.evaluation.sampling_settings` (greedy, or the temperature, top-p and top-k),
:mod:`~dflash.evaluation.sampling` (the tokens chosen by them, drafts and their verification),
:mod:`~dflash.evaluation.prompts` (the held-out prompts), :mod:`~dflash.evaluation.report` (tau,
histogram, speedup, intervals) and :mod:`~dflash.evaluation.measure` (the two decoders on the
same prompts)."""
