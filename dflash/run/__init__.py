"""One training run and its ``--out``: the config settled before anything loads
(:mod:`~dflash.run.settle`: the drafter's shape, :mod:`~dflash.run.drafter_shape`; every input
checked, :mod:`~dflash.run.preflight`; what a resume may change, :mod:`~dflash.run.resume`), the run
directory's names and checks (:mod:`~dflash.run.layout`), lock (:mod:`~dflash.run.lock`) and log
file (:mod:`~dflash.run.log_file`), its checkpoints (:mod:`~dflash.run.checkpoint`, found and
verified by :mod:`~dflash.run.step_dirs`), its compile artifacts (:mod:`~dflash.run.compile_cache`),
the held-out acceptance measured for it (:mod:`~dflash.run.acceptance_log`), and the message of a
run that runs out of GPU memory (:mod:`~dflash.run.out_of_memory`)."""
