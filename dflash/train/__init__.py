"""The training loop and its step engines: :class:`~dflash.train.trainer.Trainer` (build, loop, save)
and what it conducts: the training data (:mod:`~dflash.train.corpus`), the targets in the run's
precision (:mod:`~dflash.train.targets`), held-out acceptance during the run
(:mod:`~dflash.train.heldout`), the step engines behind one protocol (:mod:`~dflash.train.engine`: one
device, :mod:`~dflash.train.local`; target and drafter threads, :mod:`~dflash.train.threaded`), the
micro-batches they draw (:mod:`~dflash.train.jobs`), the drafter replicas they step
(:mod:`~dflash.train.replica`), one micro-batch's work (:mod:`~dflash.train.step`), the rows per
drafter forward and the first step's retry with fewer (:mod:`~dflash.train.drafter_rows`), its compiled
regions (:mod:`~dflash.train.regions`), the loss (:mod:`~dflash.train.loss`, its settings
:mod:`~dflash.train.loss_settings`, DFlash2's selector's :mod:`~dflash.train.selector_loss`), the
metrics (:mod:`~dflash.train.metrics`) and the FLOP count of the MFU estimate (:mod:`~dflash.train.flops`)."""
