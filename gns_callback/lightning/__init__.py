"""The Lightning side: what the callback reads from a ``Trainer`` and how it applies decisions to it.

Only this sub-package and :mod:`gns_callback.callback` import Lightning (``pytorch_lightning`` or
``lightning.pytorch``, see :mod:`.compat`); everything they compute with lives in framework-free modules.
"""
