"""The Lightning side: what the callback reads from a ``Trainer`` and how it applies decisions to it.

Only this sub-package, :mod:`gns_callback.callback`, the probe's adapter :mod:`gns_callback.probe.lightning` and the
demo import Lightning, and only through :mod:`.compat` (``pytorch_lightning`` or ``lightning.pytorch``, whichever is
installed); everything they compute with lives in framework-free modules.
"""
