"""The frozen target (verifier): its directory checked before it loads (:mod:`~dflash.target_model.files`),
the loaded model and the hidden states it captures (:mod:`~dflash.target_model.model`), the tapped layers
(:mod:`~dflash.target_model.taps`), packed rows kept apart per layer type (:mod:`~dflash.target_model.documents`),
the layers past the deepest tap skipped (:mod:`~dflash.target_model.layer_skip`), a hybrid cache put back
after a rejected draft (:mod:`~dflash.target_model.rollback`), its per-token work compiled as regions
(:mod:`~dflash.target_model.compiled`) and its linear layers as FP8 matmuls (:mod:`~dflash.target_model.fp8`)."""
