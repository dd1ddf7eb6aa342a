"""TransformerLens's cache-key test, run against xmix-lens.

Source: TransformerLensOrg/TransformerLens, tests/integration/test_cache_hook_names.py at commit
c688ca0cba8b215633ee7942ac655188e60acd44 (the stored version; it tests `HookedTransformer`).
Case kept: test_cache_hook_names (`run_with_cache(prompt)` caches every hook point, keys in firing order).

Changes from the original:
* Model: the hub model "solu-1l" -> the session's tiny Llama and tiny GPT-2 (`served` fixture).
* Expected keys: TL hard-codes solu-1l's list. Here the list is what TransformerLens caches on the
  same weights (`reference` fixture), restricted to the HookedTransformer-era (3.x) names that list
  uses: TL 4.x's bridge also caches its submodule names (`*.hook_in` / `*.hook_out`,
  `attn.q.hook_in`, `rotary_emb.*`, `hook_unembed`, ...), which are aliases of, or internals next
  to, the 3.x points; `unembed.hook_in` / `unembed.hook_out` stay, as in TL's list. Order is TL's.
"""
import re

import pytest

PROMPT = "Hello World!"
# 4.x-only bridge names, dropped from TL's key list to get the 3.x names the original test lists
_BRIDGE_ONLY = [r".*\.hook_(in|out)", r"hook_unembed", r"rotary_emb\..*", r".*\.attn\.hook_(cos|sin)",
                r".*\.attn\.hook_hidden_states"]
_KEEP = {"unembed.hook_in", "unembed.hook_out"}


def legacy_names(keys):
    return [k for k in keys if k in _KEEP or not any(re.fullmatch(p, k) for p in _BRIDGE_ONLY)]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_cache_hook_names(model, served, reference):
    _, theirs = reference[model].bridge.run_with_cache(PROMPT)
    expected = legacy_names(list(theirs.keys()))
    del theirs
    _, cache = served[model].run_with_cache(PROMPT)
    assert list(cache.keys()) == expected
