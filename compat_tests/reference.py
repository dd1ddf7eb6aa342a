"""The TransformerLens reference that compat tests compare xmix-lens against.

What "equal to TransformerLens" means (docs/user-guide.md, "Semantics worth knowing"): TransformerLens 4.x
``TransformerBridge.boot_transformers(local_dir)`` on the CPU in fp32, then
``enable_compatibility_mode(no_processing=True)`` -- raw weights, as vLLM serves them (TL's default
compatibility mode folds layer norms and centres weights, which shifts logits and residuals). The
user's *original* hook functions run through TL's own ``run_with_hooks`` / ``run_with_cache``;
this module only boots the bridge and forwards calls, so that what is compared is TL's behaviour,
not a re-implementation of it.

TL behaviours worth knowing when reading a comparison (TransformerLens 4.3.0):

* ``hook.name`` inside a hook is the bridge's canonical name, not the spelling that was asked
  for: a hook on ``blocks.0.hook_resid_post`` sees ``hook.name == "blocks.0.hook_out"``
  (``hook_resid_pre`` -> ``blocks.L.hook_in``). A name and its alias are one HookPoint: the
  function runs once per forward pass.
* Tensor input gets no attention mask unless one is passed. Pass ``attention_mask`` for
  left-padded batches: TL then derives position ids from it, so real tokens get positions
  0..len-1. Right padding needs no mask for the logits at real positions (causal attention).
* RMSNorm ``ln*.hook_normalized`` / ``hook_scale``: an in-place edit of ``act`` is ignored (TL
  runs HF's own norm unless the hook *returns a new tensor*); at every other site an in-place
  edit takes effect.
* On Llama-family models ``hook_pos_embed`` exists but never fires (rotary; no positional
  embedding is added to the residual).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch

HookName = Union[str, Callable[[str], bool]]
HookSpec = tuple[HookName, Callable[..., Any]]
NamesFilter = Union[None, str, list[str], Callable[[str], bool]]

__all__ = ["TLReference"]


class TLReference:
    """A TransformerLens ``TransformerBridge`` over a local HF folder, as the compat reference.

    ``bridge`` is the booted ``TransformerBridge`` (compatibility mode, no weight processing);
    everything TL offers beyond the methods below is reachable through it.
    """

    def __init__(
        self,
        model_dir: Union[str, Path],
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        no_grad: bool = True,
    ) -> None:
        # Imported here: transformer_lens takes seconds to import, and importing this module
        # (e.g. to collect tests) should not pay for it.
        from transformer_lens.model_bridge import TransformerBridge

        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"{self.model_dir} is not a model folder")
        self.bridge = TransformerBridge.boot_transformers(
            str(self.model_dir), device=device, dtype=dtype
        )
        self.bridge.enable_compatibility_mode(no_processing=True, disable_warnings=True)
        self.bridge.eval()
        self.device = torch.device(device)
        # Forward hooks behave the same with or without autograd; without it a run keeps no
        # graph. Set no_grad=False for hooks that need gradients.
        self.no_grad = no_grad

    # ---- what the bridge knows ----

    @property
    def cfg(self) -> Any:
        return self.bridge.cfg

    @property
    def tokenizer(self) -> Any:
        return self.bridge.tokenizer

    @property
    def hook_dict(self) -> dict:
        """Every accepted hook name (3.x names and 4.x bridge names) -> its HookPoint."""
        return self.bridge.hook_dict

    # ---- tokens (TL's rules: BOS prepended by default, right padding by default) ----

    def to_tokens(
        self,
        input: Union[str, list[str]],
        prepend_bos: Optional[bool] = None,
        padding_side: Optional[str] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        return self.bridge.to_tokens(
            input, prepend_bos=prepend_bos, padding_side=padding_side, **kwargs
        )

    def to_str_tokens(self, input: Any, **kwargs: Any) -> Any:
        return self.bridge.to_str_tokens(input, **kwargs)

    def to_string(self, tokens: Any) -> Any:
        return self.bridge.to_string(tokens)

    def attention_mask(
        self,
        tokens: torch.Tensor,
        padding_side: Optional[str] = None,
        prepend_bos: Optional[bool] = None,
    ) -> torch.Tensor:
        """TL's own mask for a padded batch: only leading (left) or trailing (right) pad tokens
        are masked; a BOS that shares the pad id stays unmasked."""
        from transformer_lens.utilities.tokenize_utils import get_attention_mask

        if prepend_bos is None:
            prepend_bos = getattr(self.cfg, "default_prepend_bos", True)
        return get_attention_mask(self.tokenizer, tokens, prepend_bos, padding_side)

    # ---- runs ----

    def run_with_hooks(
        self,
        tokens: Any,
        fwd_hooks: Iterable[HookSpec] = (),
        attention_mask: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """TL's ``run_with_hooks`` on ``tokens`` ([batch, pos] ids; strings are passed to TL as
        they are). Returns the logits [batch, pos, d_vocab] unless ``return_type`` says else."""
        kwargs.setdefault("return_type", "logits")
        with self._grad_context():
            return self.bridge.run_with_hooks(
                self._input(tokens),
                fwd_hooks=list(fwd_hooks),
                **self._mask_kwargs(attention_mask),
                **kwargs,
            )

    def run_with_cache(
        self,
        tokens: Any,
        names_filter: NamesFilter = None,
        attention_mask: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """TL's ``run_with_cache``: (logits, {hook name: activation}). Keys are the names the
        filter matched, plus TL's alias spellings of the same hook points."""
        with self._grad_context():
            logits, cache = self.bridge.run_with_cache(
                self._input(tokens),
                names_filter=names_filter,
                return_cache_object=False,
                **self._mask_kwargs(attention_mask),
                **kwargs,
            )
        return logits, dict(cache)

    def __call__(self, tokens: Any, attention_mask: Optional[torch.Tensor] = None, **kwargs: Any):
        """An unhooked forward (TL's ``bridge(tokens)``), logits by default."""
        with self._grad_context():
            return self.bridge(self._input(tokens), **self._mask_kwargs(attention_mask), **kwargs)

    # ---- helpers ----

    def _grad_context(self) -> contextlib.AbstractContextManager:
        return torch.no_grad() if self.no_grad else contextlib.nullcontext()

    def _input(self, tokens: Any) -> Any:
        if isinstance(tokens, torch.Tensor):
            if tokens.is_floating_point():
                raise TypeError("tokens must be integer token ids, got a floating-point tensor")
            return tokens.to(device=self.device, dtype=torch.long)
        return tokens

    def _mask_kwargs(self, attention_mask: Optional[torch.Tensor]) -> dict:
        if attention_mask is None:
            return {}
        return {"attention_mask": attention_mask.to(self.device)}
