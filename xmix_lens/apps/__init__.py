"""Seven interpretability applications, each a function that builds an `xmix_lens.App`.

    from xmix_lens import apps
    model.install(apps.activation_addition("joy", {12: joy_direction}, coef=8.0))

Their directions, probes and SAEs come from `xmix_lens.apps.derive` (computed from the model's own
activations on the prompt sets in `xmix_lens/apps/data/`). docs/apps.md has the measured effects.
"""
from .builders import (activation_addition, conditional_steering, directional_ablation, harmful_request_detector,
                       inference_time_intervention, linear_probe, sae_features)
from .sae import SAE, load_sae, save_sae

__all__ = ["SAE", "activation_addition", "conditional_steering", "directional_ablation", "harmful_request_detector",
           "inference_time_intervention", "linear_probe", "load_sae", "sae_features", "save_sae"]
