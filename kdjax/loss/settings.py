"""`LossSettings`: the loss's static arguments, as a jitted training step takes them."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class LossSettings:
  """The static loss arguments of the jitted step."""
  objective: str
  temperature: float
  ce_weight: float
  impl: str
  chunk_size: int
  dw_dtype: str
  position_metrics: bool = True
  hidden_weight: float = 0.0
  divergence: str = "forward"  # objective "online" only (kdjax.loss.full_kl)
  skew: float = 0.1

  @classmethod
  def from_config(cls, g, hard_labels: bool) -> "LossSettings":
    # Hard labels are a one-hot teacher: K = 1, id = next token, log-prob 0, for which the sparse
    # KL is exactly the cross-entropy.
    if hard_labels:
      return cls("sparse", 1.0, 0.0, g.impl, g.chunk_size, g.dw_dtype, g.position_metrics)
    return cls(g.objective, g.temperature, g.ce_weight, g.impl, g.chunk_size, g.dw_dtype,
               g.position_metrics, g.hidden_weight, g.divergence, g.skew)
