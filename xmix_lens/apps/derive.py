"""Directions, probes and SAEs computed from a model's own activations, with xmix-lens itself
(`run_with_cache` over batches of prompts), and the statistics that evaluate them.

The prompt sets are in `xmix_lens/apps/data/`: `split` holds every third item out, so that an
evaluation never sees the items a direction or probe was derived from. `shuffled` gives the
control: the same pipeline on permuted labels."""
from pathlib import Path

import torch

from .sae import SAE

DATA = Path(__file__).parent / "data"


def load_lines(name: str) -> list[str]:
    """The non-empty lines of data/<name>."""
    return [line.strip() for line in (DATA / name).read_text().splitlines() if line.strip()]


def load_statements() -> list[tuple[str, str]]:
    """(true statement, false statement) pairs from data/facts.txt."""
    return [tuple(line.split("|")) for line in load_lines("facts.txt")]


def split(items: list) -> tuple[list, list]:
    """(derivation items, held-out items): every third item is held out."""
    return [x for i, x in enumerate(items) if i % 3 != 2], [x for i, x in enumerate(items) if i % 3 == 2]


def activations(model, prompts: list[str], hook_name: str, batch_size: int = 32) -> list[torch.Tensor]:
    """Each prompt's activations at `hook_name` at its real positions, [len, *features]."""
    return activations_at(model, prompts, [hook_name], batch_size)[hook_name]


def activations_at(model, prompts: list[str], hook_names: list[str], batch_size: int = 32) -> dict:
    """{hook name: each prompt's activations there at its real positions, [len, *features]}, from
    one cached run per batch."""
    out = {name: [] for name in hook_names}
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start: start + batch_size]
        _, cache = model.run_with_cache(batch, names_filter=lambda n: n in out, padding_side="left",
                                        return_type=None)
        for name in hook_names:
            acts = cache[name]
            for row, prompt in enumerate(batch):
                n = len(model.to_tokens(prompt)[0])
                out[name].append(acts[row, acts.shape[1] - n:].clone())
    return out


def last(acts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([a[-1] for a in acts])


def mean(acts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([a.mean(0) for a in acts])


def head_means(model, prompts: list[str]) -> dict[int, torch.Tensor]:
    """Per layer, the prompts' mean attn.hook_z ([n_prompts, n_heads, d_head]): ITI's statistics."""
    hooks = [f"blocks.{L}.attn.hook_z" for L in range(model.cfg.n_layers)]
    acts = activations_at(model, prompts, hooks)
    return {L: mean(acts[name]) for L, name in enumerate(hooks)}


def mean_cosine(acts: list[torch.Tensor], direction: torch.Tensor) -> torch.Tensor:
    """Per prompt: the mean over its tokens of cos(act, direction) (conditional steering's condition)."""
    d = direction / direction.norm()
    return torch.stack([((a @ d) / a.norm(dim=-1)).mean() for a in acts])


def mean_difference(X: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """mean(X | label 1) - mean(X | label 0): the contrastive direction."""
    labels = labels.bool()
    return X[labels].mean(0) - X[~labels].mean(0)


def mass_mean_probe(X: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A difference-of-means probe (w, b): score = x @ w + b, 0 halfway between the class means."""
    w = mean_difference(X, labels)
    labels = labels.bool()
    midpoint = (X[labels].mean(0) + X[~labels].mean(0)) / 2
    return w, float(-(midpoint @ w))


def ridge_lda_probe(X: torch.Tensor, labels: torch.Tensor, ridge: float = 1.0) -> tuple[torch.Tensor, float]:
    """A linear discriminant probe (w, b): the mean difference whitened by the within-class
    covariance plus `ridge` times its mean eigenvalue (few examples, many dims); 0 halfway between
    the class means."""
    labels = labels.bool()
    mu1, mu0 = X[labels].mean(0), X[~labels].mean(0)
    centred = torch.cat([X[labels] - mu1, X[~labels] - mu0])
    cov = centred.T @ centred / len(X)
    w = torch.linalg.solve(cov + ridge * cov.trace() / cov.shape[0] * torch.eye(cov.shape[0]), mu1 - mu0)
    return w, float(-((mu1 + mu0) / 2) @ w)


def by_label(per_layer: dict, labels: torch.Tensor) -> tuple[dict, dict]:
    """({layer: rows with label 1}, {layer: rows with label 0}), as `head_shifts` takes them."""
    labels = labels.bool()
    return {k: v[labels] for k, v in per_layer.items()}, {k: v[~labels] for k, v in per_layer.items()}


def shuffled(labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The control: the labels permuted (a fixed permutation per seed)."""
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve: the chance that a positive scores above a negative (ties half)."""
    labels = labels.bool()
    pos, neg = scores[labels][:, None], scores[~labels][None, :]
    return float(((pos > neg).float() + 0.5 * (pos == neg).float()).mean())


def separation(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """(mean score of label 1 - mean of label 0) / the scores' standard deviation."""
    labels = labels.bool()
    return float((scores[labels].mean() - scores[~labels].mean()) / scores.std())


def accuracy(scores: torch.Tensor, labels: torch.Tensor, threshold: float = 0.0) -> float:
    return float(((scores > threshold) == labels.bool()).float().mean())


def head_shifts(z_true: torch.Tensor, z_false: torch.Tensor, z_val_true: torch.Tensor, z_val_false: torch.Tensor,
                top_k: int) -> tuple[dict, dict]:
    """ITI: per head a mass-mean probe on its `attn.hook_z` output; the `top_k` heads whose probes
    are most accurate on the validation items get a shift of one standard deviation along their
    mean difference. z_*: {layer: [N, n_heads, d_head]}. Returns ({(layer, head): shift}, {(layer,
    head): validation accuracy})."""
    scored = {}
    for layer in z_true:
        for head in range(z_true[layer].shape[1]):
            X = torch.cat([z_true[layer][:, head], z_false[layer][:, head]])
            y = torch.cat([torch.ones(len(z_true[layer])), torch.zeros(len(z_false[layer]))])
            w, b = mass_mean_probe(X, y)
            Xv = torch.cat([z_val_true[layer][:, head], z_val_false[layer][:, head]])
            yv = torch.cat([torch.ones(len(z_val_true[layer])), torch.zeros(len(z_val_false[layer]))])
            scored[(layer, head)] = (accuracy(Xv @ w + b, yv), w, X)
    best = sorted(scored, key=lambda lh: -scored[lh][0])[:top_k]
    shifts = {}
    for lh in best:
        _, w, X = scored[lh]
        unit = w / w.norm()
        shifts[lh] = float((X @ unit).std()) * unit
    return shifts, {lh: scored[lh][0] for lh in best}


def train_sae(acts: torch.Tensor, d_sae: int, k: int, hook_name: str, steps: int = 400, lr: float = 1e-3,
              seed: int = 0) -> SAE:
    """A top-k SAE on activations [N, d_in]: reconstruction loss, Adam, unit-norm decoder rows."""
    g = torch.Generator().manual_seed(seed)
    d_in = acts.shape[1]
    W_dec = torch.randn(d_sae, d_in, generator=g)
    W_dec = (W_dec / W_dec.norm(dim=1, keepdim=True)).requires_grad_()
    W_enc = W_dec.detach().T.clone().requires_grad_()
    b_enc = torch.zeros(d_sae, requires_grad=True)
    b_dec = acts.mean(0).clone().requires_grad_()
    opt = torch.optim.Adam([W_enc, b_enc, W_dec, b_dec], lr=lr)
    scale = acts.norm(dim=1).mean()
    for _ in range(steps):
        batch = acts[torch.randint(len(acts), (256,), generator=g)]
        sae = SAE(W_enc, b_enc, W_dec, b_dec, hook_name, "topk", k)
        loss = ((sae.decode(sae.encode(batch)) - batch) ** 2).sum(-1).mean() / scale ** 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            W_dec /= W_dec.norm(dim=1, keepdim=True)
    return SAE(W_enc.detach(), b_enc.detach(), W_dec.detach(), b_dec.detach(), hook_name, "topk", k)


def variance_explained(sae: SAE, acts: torch.Tensor) -> float:
    """1 - |x - SAE(x)|^2 / |x - mean x|^2 over the rows of acts."""
    with torch.no_grad():
        residual = ((sae.decode(sae.encode(acts)) - acts) ** 2).sum()
    return float(1 - residual / ((acts - acts.mean(0)) ** 2).sum())


def token_ids(model, words: list[str]) -> list[int]:
    """The first token of each word (as it follows a space)."""
    return [model.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in words]


POSITIVE_WORDS = [" great", " good", " wonderful", " amazing", " excellent", " lovely", " happy", " beautiful"]
NEGATIVE_WORDS = [" bad", " terrible", " awful", " horrible", " sad", " boring", " ugly", " poor"]


def sentiment_logit_gap(model, logits_last: torch.Tensor) -> torch.Tensor:
    """Per row: logsumexp of the log-probs of positive words minus that of negative words at the
    last position (logits_last [batch, d_vocab])."""
    logp = logits_last.log_softmax(-1)
    return (logp[:, token_ids(model, POSITIVE_WORDS)].logsumexp(-1)
            - logp[:, token_ids(model, NEGATIVE_WORDS)].logsumexp(-1))
