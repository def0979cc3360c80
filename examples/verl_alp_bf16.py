"""How much of ALP's noise survives verl's default ``param_dtype: bf16`` — the measurement behind docs/frameworks/verl.md.

verl's FSDP2 engine casts every ``fully_shard``-ed decoder layer's inputs to ``param_dtype`` (bf16 by default) in
FSDP2's pre-forward hook, which runs before ALP's (arXiv 2603.19470) hook: the noise is added in float32 and the sum
rounded back to bf16, exactly as :class:`offpolicy.LayerwisePerturbation` does with a 16-bit hidden state. bf16 keeps
8 significant bits, so h + σε rounds back to h unless |σε| exceeds half a spacing, ≈ |h| / 256.

This script runs the embedded ``lab`` model (cached; built on first use, ~2 min on CPU) in bf16 on a few of its task
prompts, records every decoder layer's input, and prints, for each σ, the share of hidden-state elements the noise
changes and the RMS of the noise that survives the rounding relative to σ (1.0 = all of it). Writes nothing. Run:

    python examples/verl_alp_bf16.py                # ≈ 25 s on 2 cores (the lab model cached or shipped)
"""

from __future__ import annotations

import torch

from offpolicy.models import load_model
from offpolicy.perturbation import find_decoder_layers

SIGMAS = (1e-4, 1e-3, 1e-2, 3e-2, 1e-1)


def layer_inputs(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Each decoder layer's input hidden state [B, T, H] in the model's dtype."""
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).detach()), with_kwargs=True)
        for layer in find_decoder_layers(model)]
    with torch.no_grad():
        model(input_ids=input_ids)
    for h in hooks:
        h.remove()
    return seen


def survival(h: torch.Tensor, sigma: float, generator: torch.Generator) -> tuple[float, float]:
    """(share of elements changed, RMS(kept noise) / σ) when σε is added in float32 and rounded to h's dtype."""
    eps = torch.randn(h.shape, generator=generator)
    noisy = (h.float() + sigma * eps).to(h.dtype)
    kept = noisy.float() - h.float()
    return (noisy != h).float().mean().item(), (kept.pow(2).mean().sqrt() / sigma).item()


def main() -> None:
    model, tokenizer = load_model("lab")
    model = model.to(torch.bfloat16)
    prompts = ["12 + 7 =", "What is 3 * 4?", "Reverse: abc", "Sort 3 1 2:"] * 2
    input_ids = tokenizer(prompts, return_tensors="pt", padding=True).input_ids
    hidden = layer_inputs(model, input_ids)
    g = torch.Generator().manual_seed(0)
    print(f"lab model, bf16, {len(hidden)} decoder layers; median |h| per layer: "
          + ", ".join(f"{h.float().abs().median().item():.3g}" for h in hidden))
    print("sigma    elements changed, layer 0 … last    kept noise RMS / sigma, layer 0 … last")
    for sigma in SIGMAS:
        rows = [survival(h, sigma, g) for h in hidden]
        changed = " ".join(f"{r[0]:6.1%}" for r in rows)
        kept = " ".join(f"{r[1]:5.2f}" for r in rows)
        print(f"{sigma:<8.0e} {changed}    {kept}")


if __name__ == "__main__":
    main()
