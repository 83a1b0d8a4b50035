"""The drafter being trained: its self-contained modeling file that every checkpoint carries
(:mod:`~dflash.drafter.modeling_dflash`), the model the trainer and ``dflash eval`` run and the config
built for a target (:mod:`~dflash.drafter.model`), its mask token (:mod:`~dflash.drafter.mask_token`),
a ``config.json`` every loader reads alike (:mod:`~dflash.drafter.hf_config`), a drafter directory
read strictly and checked against a target (:mod:`~dflash.drafter.files`), and DFlash2 selector
codebooks projected from the target's embeddings for training (:mod:`~dflash.drafter.codebooks`)."""
