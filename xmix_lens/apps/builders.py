"""The seven applications. Each function returns an `App` whose hooks close over `app.params`
(so `model.set_params` retargets them in place) and keep their reads in `app.outputs`.

Reads of "the end of the prompt" (`act[:, -1]`) need left padding (`padding_side="left"`) when
prompts of different lengths share a call: with right padding the last position of a short row
is padding, which the engine does not compute (it reads 0)."""
from collections.abc import Iterable

import torch

from ..app import App
from ..stores import store
from .sae import SAE


def _vector(x, what: str) -> torch.Tensor:
    x = torch.as_tensor(x, dtype=torch.float32).detach().clone()
    if x.dim() != 1:
        raise ValueError(f"{what} must be a vector [d], got shape {list(x.shape)}")
    return x


def _unit(x, what: str) -> torch.Tensor:
    x = _vector(x, what)
    norm = x.norm()
    if not torch.isfinite(norm) or norm == 0:
        raise ValueError(f"{what} must be a finite non-zero vector")
    return x / norm


def activation_addition(name: str, directions: dict[int, torch.Tensor], coef: float = 1.0,
                        hook: str = "hook_resid_post") -> App:
    """ActAdd / contrastive activation addition: `act + coef * directions[L]` at blocks.L.<hook>,
    at every position (prompt and generated tokens)."""
    params = {"coef": torch.tensor(float(coef))}
    params.update({f"direction.{layer}": _vector(v, f"direction for layer {layer}") for layer, v in directions.items()})
    app = App(name, params=params, description="activation addition")

    def steer_at(layer):
        def steer(act, hook):
            return act + params["coef"] * params[f"direction.{layer}"]
        return steer

    for layer in directions:
        app.fwd_hooks.append((f"blocks.{layer}.{hook}", steer_at(layer)))
        app.param_sites[f"direction.{layer}"] = (f"blocks.{layer}.{hook}", 0)
    return app


def directional_ablation(name: str, direction: torch.Tensor, n_layers: int) -> App:
    """Remove a direction from the residual stream at every layer (refusal-direction ablation):
    project it out of the embedding and of every attention and MLP output, so no residual stream
    of any layer carries it."""
    params = {"direction": _unit(direction, "the ablated direction")}
    d = params["direction"]

    def project_out(act, hook):
        return act - (act @ d)[..., None] * d

    sites = ["blocks.0.hook_resid_pre"] + [f"blocks.{L}.{s}" for L in range(n_layers)
                                            for s in ("hook_attn_out", "hook_mlp_out")]
    return App(name, fwd_hooks=[(s, project_out) for s in sites], params=params,
               param_sites={"direction": ("blocks.0.hook_resid_pre", 0)}, description="directional ablation")


def linear_probe(name: str, hook_name: str, w: torch.Tensor, b: float = 0.0) -> App:
    """A linear probe read with the output: outputs["scores"] per token [batch, pos] and
    outputs["last"] at the last position [batch] (`act @ w + b`)."""
    params = {"w": _vector(w, "the probe's weights"), "b": torch.tensor(float(b))}
    app = App(name, params=params, param_sites={"w": (hook_name, 0)}, description="linear probe")

    def probe(act, hook):
        app.outputs["scores"] = act @ params["w"] + params["b"]
        app.outputs["last"] = act[:, -1] @ params["w"] + params["b"]

    app.fwd_hooks.append((hook_name, probe))
    return app


def conditional_steering(name: str, condition_hook: str, condition_direction: torch.Tensor, threshold: float,
                         directions: dict[int, torch.Tensor], coef: float = 1.0, hook: str = "hook_resid_post") -> App:
    """CAST-style conditional steering. The condition: the mean over the prompt's tokens of the
    cosine similarity between the residual at `condition_hook` and `condition_direction`, kept per
    request on the device (a store). Where it exceeds `threshold`, `coef * directions[L]` is
    added at blocks.L.<hook> on the prompt and on every generated token. outputs: "similarity"
    and "gate" per request."""
    c = _unit(condition_direction, "the condition direction")
    params = {"condition": c, "threshold": torch.tensor(float(threshold)), "coef": torch.tensor(float(coef))}
    params.update({f"direction.{layer}": _vector(v, f"direction for layer {layer}") for layer, v in directions.items()})
    key = f"{name}.similarity"
    app = App(name, params=params, param_sites={"condition": (condition_hook, 0)}, description="conditional steering")

    def condition(act, hook):
        store.put(key, (act @ params["condition"]) / act.norm(dim=-1), reduce="mean")

    app.fwd_hooks.append((condition_hook, condition))
    first = min(directions)

    def steer_at(layer):
        def steer(act, hook):
            gate = store.get(key) > params["threshold"]
            if layer == first:
                app.outputs["similarity"] = store.get(key)[:, -1]
                app.outputs["gate"] = gate[:, -1] * 1.0
            return act + gate[..., None] * (params["coef"] * params[f"direction.{layer}"])
        return steer

    for layer in sorted(directions):
        app.fwd_hooks.append((f"blocks.{layer}.{hook}", steer_at(layer)))
        app.param_sites[f"direction.{layer}"] = (f"blocks.{layer}.{hook}", 0)
    return app


def harmful_request_detector(name: str, hook_name: str, w: torch.Tensor, b: float, threshold: float = 0.0,
                             refusal_directions: dict[int, torch.Tensor] | None = None, coef: float = 1.0) -> App:
    """Jailbreak / harmful-request detection: a probe on the prompt's residual at `hook_name`,
    averaged over the prompt's tokens, is final at the end of the prompt and kept per request on the
    device. outputs: "score" and "flag" (score > threshold) per request. With
    `refusal_directions` ({layer: vector}), flagged requests also get `coef * vector` added at
    blocks.L.hook_resid_post on every token (a refusal steer); others are untouched."""
    params = {"w": _vector(w, "the probe's weights"), "b": torch.tensor(float(b)),
              "threshold": torch.tensor(float(threshold)), "coef": torch.tensor(float(coef))}
    refusal_directions = refusal_directions or {}
    params.update({f"refusal.{layer}": _vector(v, f"refusal direction for layer {layer}")
                   for layer, v in refusal_directions.items()})
    key = f"{name}.score"
    app = App(name, params=params, param_sites={"w": (hook_name, 0)}, description="harmful-request detection")

    def probe(act, hook):
        store.put(key, act @ params["w"] + params["b"], reduce="mean")

    def report(act, hook):  # at the final norm, after every layer: the prompt's mean is complete
        score = store.get(key)[:, -1]
        app.outputs["score"] = score
        app.outputs["flag"] = (score > params["threshold"]) * 1.0

    app.fwd_hooks += [(hook_name, probe), ("ln_final.hook_normalized", report)]

    def refuse_at(layer):
        def refuse(act, hook):
            flagged = store.get(key) > params["threshold"]
            return act + flagged[..., None] * (params["coef"] * params[f"refusal.{layer}"])
        return refuse

    for L in sorted(refusal_directions):
        app.fwd_hooks.append((f"blocks.{L}.hook_resid_post", refuse_at(L)))
        app.param_sites[f"refusal.{L}"] = (f"blocks.{L}.hook_resid_post", 0)
    return app


def inference_time_intervention(name: str, shifts: dict[tuple[int, int], torch.Tensor], n_heads: int,
                                alpha: float = 1.0) -> App:
    """ITI: shift selected heads' outputs (`attn.hook_z`, [batch, pos, n_heads, d_head]) by
    `alpha * shifts[(layer, head)]` at every position."""
    if not shifts:
        raise ValueError("ITI needs at least one (layer, head) shift")
    sizes = {_vector(v, f"shift of head {lh}").shape[0] for lh, v in shifts.items()}
    if len(sizes) != 1:
        raise ValueError(f"ITI shifts must all have one size (d_head); got sizes {sorted(sizes)}")
    (d_head,) = sizes
    params = {"alpha": torch.tensor(float(alpha))}
    for (layer, head), v in shifts.items():
        if not 0 <= head < n_heads:
            raise ValueError(f"head {head} of layer {layer} is outside [0, {n_heads})")
        table = params.setdefault(f"shift.{layer}", torch.zeros(n_heads, d_head))
        table[head] = _vector(v, f"shift of head {(layer, head)}")
    app = App(name, params=params, description="inference-time intervention")

    def shift_at(layer):
        def shift(act, hook):
            return act + params["alpha"] * params[f"shift.{layer}"]
        return shift

    for layer in sorted({layer for layer, _ in shifts}):
        app.fwd_hooks.append((f"blocks.{layer}.attn.hook_z", shift_at(layer)))
        app.param_sites[f"shift.{layer}"] = (f"blocks.{layer}.attn.hook_z", 1)
    return app


def sae_features(name: str, sae: SAE, read: Iterable[int] = (), clamp: dict[int, float] | None = None) -> App:
    """Read SAE feature activations and clamp features, at the SAE's hook point.

    outputs["features"]: the activations of the features in `read`, [batch, pos, len(read)].
    `clamp` {feature: value}: the residual gets `(value - f) * W_dec[feature]` added per token,
    so that the feature reads `value` and the SAE's reconstruction error is kept."""
    read, clamp = list(read), dict(clamp or {})
    for i in read + list(clamp):
        if not 0 <= i < sae.d_sae:
            raise ValueError(f"SAE feature {i} is outside [0, {sae.d_sae})")
    params = {"W_enc": sae.W_enc, "b_enc": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec,
              "read": torch.eye(sae.d_sae)[:, read], "clamp_select": torch.eye(sae.d_sae)[:, list(clamp)],
              "clamp_values": torch.tensor(list(clamp.values()), dtype=torch.float32),
              "clamp_decoder": sae.W_dec[list(clamp)].clone()}
    encoder = SAE(params["W_enc"], params["b_enc"], params["W_dec"], params["b_dec"], sae.hook_name, sae.activation,
                  sae.k)
    app = App(name, params=params, param_sites={"W_enc": (sae.hook_name, 0)}, description="SAE features")

    def features(act, hook):
        f = encoder.encode(act)
        if read:
            app.outputs["features"] = f @ params["read"]
        if clamp:
            return act + (params["clamp_values"] - f @ params["clamp_select"]) @ params["clamp_decoder"]

    app.fwd_hooks.append((sae.hook_name, features))
    return app
