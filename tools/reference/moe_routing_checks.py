"""Proofs that the MoE fixtures route robustly, and that their routers' switches matter.

Expert choice is a discontinuity: if the k-th and (k+1)-th expert scores of a
token are within float32 noise of each other, another engine may pick the other
expert and its logits jump. So every expert choice the fixtures depend on (prompt
and greedy continuation, every MoE layer) must win by `MIN_ROUTING_MARGIN` in the
router's own selection score: softmax probability, or DeepSeek-V3's sigmoid score
plus `e_score_correction_bias` (and, with expert groups, the group score that
decides which groups are searched).

For DeepSeek-V3 routers it also counts the choices that the correction bias and
the group limit change, so a fixture can prove that an engine ignoring either is
caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Router scores are probabilities in [0, 1] computed in float32 (noise ~1e-7);
# another engine's summation order moves them by ~1e-6. A 1e-4 gap is 100x that.
MIN_ROUTING_MARGIN = 1e-4


@dataclass
class RoutingStats:
    """Summary over every routed token of every MoE layer."""

    routings: int = 0
    min_margin: float = float("inf")
    bias_changed: int = 0
    group_changed: int = 0
    # Per sequence position: the smallest margin over the layers.
    per_position: list[float] = field(default_factory=list)

    def add(self, other: RoutingStats, margins: torch.Tensor) -> None:
        self.routings += other.routings
        self.min_margin = min(self.min_margin, other.min_margin)
        self.bias_changed += other.bias_changed
        self.group_changed += other.group_changed
        values = margins.tolist()
        if not self.per_position:
            self.per_position = values
        elif len(values) != len(self.per_position):
            raise AssertionError("routers saw different token counts")
        else:
            self.per_position = [min(a, b) for a, b in zip(self.per_position, values)]

    def note(self) -> str:
        text = f"{self.routings} token-layer expert choices, smallest winning margin {self.min_margin:.3g}"
        if self.bias_changed or self.group_changed:
            text += (
                f"; e_score_correction_bias changes {self.bias_changed} of them, "
                f"the group limit (n_group/topk_group) {self.group_changed}"
            )
        return text


def _kth_gap(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: k-th largest minus (k+1)-th largest."""
    top = scores.topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def _selection(scores: torch.Tensor, k: int) -> torch.Tensor:
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def _softmax_router(router, h: torch.Tensor) -> tuple[RoutingStats, torch.Tensor]:
    logits = torch.nn.functional.linear(h.float(), router.weight.float())
    probs = logits.softmax(dim=-1)
    margin = _kth_gap(probs, router.top_k)
    return RoutingStats(routings=h.shape[0], min_margin=float(margin.min())), margin


def _deepseek_v3_router(router, h: torch.Tensor) -> tuple[RoutingStats, torch.Tensor]:
    logits = torch.nn.functional.linear(h.float(), router.weight.float())
    scores = logits.sigmoid()
    n_group, topk_group, k = router.num_group, router.topk_group, router.top_k
    n_exp = scores.shape[-1]

    def choose(choice: torch.Tensor, grouped: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not grouped or n_group == 1:
            return _selection(choice, k), _kth_gap(choice, k)
        group_scores = choice.view(-1, n_group, n_exp // n_group).topk(2, dim=-1).values.sum(dim=-1)
        group_gap = _kth_gap(group_scores, topk_group)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        keep = keep.unsqueeze(-1).expand(-1, n_group, n_exp // n_group).reshape(-1, n_exp).bool()
        masked = choice.masked_fill(~keep, float("-inf"))
        return _selection(masked, k), torch.minimum(group_gap, _kth_gap(masked, k))

    biased = scores + router.e_score_correction_bias.float()
    chosen, margin = choose(biased, grouped=True)
    unbiased, _ = choose(scores, grouped=True)
    ungrouped, _ = choose(biased, grouped=False)
    stats = RoutingStats(
        routings=h.shape[0],
        min_margin=float(margin.min()),
        bias_changed=int((chosen != unbiased).any(dim=-1).sum()),
        group_changed=int((chosen != ungrouped).any(dim=-1).sum()),
    )
    return stats, margin


def router_stats(router, h: torch.Tensor) -> tuple[RoutingStats, torch.Tensor]:
    """Margins (and DeepSeek-V3 switch effects) of one router on its inputs h [tokens, hidden],
    and each token's margin."""
    kind = type(router).__name__
    if kind == "DeepseekV2TopkRouter" and router.topk_method != "greedy":
        raise ValueError(f"{kind} topk_method {router.topk_method} is not checked here")
    with torch.no_grad():
        if kind in ("DeepseekV3TopkRouter", "DeepseekV32TopkRouter", "KimiLinearTopkRouter"):
            return _deepseek_v3_router(router, h)
        if kind in (
            "DeepseekV2TopkRouter",
            "MixtralTopKRouter",
            "Qwen2MoeTopKRouter",
            "Qwen3MoeTopKRouter",
            "Qwen3NextTopKRouter",
            "Qwen3_5MoeTopKRouter",
        ):
            return _softmax_router(router, h)
    raise ValueError(f"unknown router {kind}")


def routers(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter"))]


def collect(module: torch.nn.Module, run) -> RoutingStats:
    """Run `run()` while recording the inputs of every router inside `module`."""
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []
    hooks = [
        r.register_forward_hook(lambda mod, args, out: seen.append((mod, args[0].reshape(-1, args[0].shape[-1]))))
        for r in routers(module)
    ]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        raise AssertionError("no router ran")
    total = RoutingStats()
    for router, h in seen:
        total.add(*router_stats(router, h.detach()))
    return total


def check_model(model: torch.nn.Module, ids: list[int]) -> RoutingStats:
    """Routing stats of a causal LM over `ids` (prompt plus the greedy tokens fed back)."""
    stats = collect(model, lambda: model(torch.tensor([ids]), use_cache=False))
    if stats.min_margin < MIN_ROUTING_MARGIN:
        raise AssertionError(f"routing margin {stats.min_margin} below {MIN_ROUTING_MARGIN}; pick another seed")
    return stats
