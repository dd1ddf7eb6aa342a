"""Two apps for the evaluation example (docs/user-guide.md, "Evaluating over a dataset"):

- `joy`: adds `scale` times a joy-minus-sadness direction to the residual stream of layer 12, at
  every position; `scale` is a request parameter, so each row (or a sweep) sets its own;
- `sentiment`: reads the residual stream of layer 20 along the same direction (a mean-difference
  probe), per token.

    xmix-lens eval --apps examples/sentiment_apps.py:build --input examples/sentiment.jsonl \\
        --output results.jsonl --sweep joy.scale=0,4,8,12
"""
import torch

from xmix_lens import App

POSITIVE = ["I love this, it is wonderful", "What a happy, joyful day", "This is great and I am glad",
            "She smiled with delight", "We laughed and celebrated together", "The news filled me with joy"]
NEGATIVE = ["I hate this, it is awful", "What a sad, miserable day", "This is terrible and I am upset",
            "She frowned with disgust", "We cried and mourned together", "The news filled me with grief"]


def direction(model, layer: int) -> torch.Tensor:
    """Mean last-token residual of the positive prompts minus that of the negative ones."""
    name = f"blocks.{layer}.hook_resid_post"
    _, pos = model.run_with_cache(POSITIVE, names_filter=name, padding_side="left")
    _, neg = model.run_with_cache(NEGATIVE, names_filter=name, padding_side="left")
    return pos[name][:, -1].mean(0) - neg[name][:, -1].mean(0)


def build(model) -> list[App]:
    steer = {"v": direction(model, 12) / direction(model, 12).norm(), "scale": torch.tensor(0.0)}
    probe = {"w": direction(model, 20) / direction(model, 20).norm()}
    joy = App("joy", fwd_hooks=[("blocks.12.hook_resid_post", lambda act, hook: act + steer["v"] * steer["scale"])],
              params=steer, request_params={"scale": (-16.0, 16.0)}, description="steer towards joy")
    sentiment = App("sentiment", params=probe, description="joy-minus-sadness probe at layer 20")

    def read(act, hook):
        sentiment.outputs["score"] = act @ probe["w"]

    sentiment.fwd_hooks = [("blocks.20.hook_resid_post", read)]
    return [joy, sentiment]
