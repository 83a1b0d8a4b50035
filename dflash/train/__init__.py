"""The training loop and its step engines: :class:`~dflash.train.trainer.Trainer` (build, loop, save),
the step engines behind one protocol (:mod:`~dflash.train.engine`: one device, :mod:`~dflash.train.local`;
target and drafter threads, :mod:`~dflash.train.threaded`), the micro-batches they draw
(:mod:`~dflash.train.jobs`), the drafter replicas they step (:mod:`~dflash.train.replica`), one
micro-batch's work (:mod:`~dflash.train.step`), the loss (:mod:`~dflash.train.loss`, its settings
:mod:`~dflash.train.loss_settings`, DFlash2's selector's :mod:`~dflash.train.selector_loss`) and the FLOP
count of the MFU estimate (:mod:`~dflash.train.flops`)."""
