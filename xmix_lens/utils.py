"""TransformerLens's utilities, under the names TransformerLens users write:

    from xmix_lens import utils        # was: from transformer_lens import utils
    utils.get_act_name("resid_post", 3)          # "blocks.3.hook_resid_post"
    utils.test_prompt("The capital of France is", "Paris", model)
    utils.to_numpy(logits)

TransformerLens 4 moved `transformer_lens.utils` to `transformer_lens.utilities` (same names); this
module re-exports that package's public names, so code written for either keeps working. They are
TransformerLens's own functions, not copies: those that take a model (test_prompt) call only the
model's TransformerLens methods (to_tokens, to_str_tokens, to_string, model(tokens)), which a
HookedServedModel has, so they work on it as on a TransformerLens model.
"""
from types import ModuleType as _ModuleType

import transformer_lens.utilities as _tl_utilities
from transformer_lens.utilities import *  # noqa: F401,F403  (the package has no __all__: every public name)

# The star import brings every public name of the package's namespace; an activation function that
# TransformerLens defines beside gelu_new, gelu_fast and solu, but leaves out of that namespace:
from transformer_lens.utilities.activation_functions import gelu_pytorch_tanh  # noqa: F401

__all__ = sorted(
    [name for name, value in vars(_tl_utilities).items()
     if not name.startswith("_") and not isinstance(value, _ModuleType)]  # its submodules are not utilities
    + ["gelu_pytorch_tanh"]
)
