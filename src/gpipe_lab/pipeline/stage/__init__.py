"""The stage's work: one stage's forward, backward and weight gradients per micro-batch.

``runtime.StageRuntime`` runs them; around it: what a stage keeps per step (``stage_state``),
re-materialization (``checkpointing``), random draws that replay (``context``, ``random_replay``,
``replay_policy``, ``dropout``), deferred BatchNorm (``batchnorm``), split backward
(``weight_gradients``, ``linear_weights``), in-place input writes, compiled stages, the walk over
its modules and its saved-activation count.
"""
