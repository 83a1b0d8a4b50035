"""The frozen target (verifier): its directory checked before it loads (:mod:`~dflash.target.files`),
the loaded model and the hidden states it captures (:mod:`~dflash.target.model`), the tapped layers
(:mod:`~dflash.target.taps`), packed rows kept apart per layer type (:mod:`~dflash.target.documents`),
the layers past the deepest tap skipped (:mod:`~dflash.target.layer_skip`) and a hybrid cache put back
after a rejected draft (:mod:`~dflash.target.rollback`)."""
