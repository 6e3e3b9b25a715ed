"""Dense multi-head attention: every head, equal weight. The baseline the routed variants are measured against."""
from .registry import AttentionVariant, register_attention


@register_attention("mha")
class MHA(AttentionVariant):
    """Mixin that leaves the form as it is: ``build_attention("mha", ...)`` is the form's own dense
    attention. Every contract answer is the dense default of :class:`AttentionVariant`."""
