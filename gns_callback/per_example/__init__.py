"""Per-example squared gradient norms without materialising per-example gradients: exact, or for long sequences
through wide layers an unbiased random-probe sketch (:mod:`.sketch`)."""

from .conv import conv_sq_norms, unfold_input
from .embedding import embedding_sq_norms, embedding_unsupported_reason
from .linear import linear_sq_norms, prefers_gram, sequence_sq_norms
from .normalization import group_norm_sq_norms, layer_norm_sq_norms, rms_norm_sq_norms
from .tracker import SUPPORTED_MODULES, PerExampleNormTracker

__all__ = [
    "SUPPORTED_MODULES",
    "PerExampleNormTracker",
    "conv_sq_norms",
    "embedding_sq_norms",
    "embedding_unsupported_reason",
    "group_norm_sq_norms",
    "layer_norm_sq_norms",
    "linear_sq_norms",
    "prefers_gram",
    "rms_norm_sq_norms",
    "sequence_sq_norms",
    "unfold_input",
]
