"""The local transport's process mode: ``GPipe(..., local_stages="processes")``.

Every pipeline rank but the last runs in a stage process of its own on this machine; the
caller's process runs the last rank (so the loss function and the targets never leave it)
and drives the others. Parameters, buffers and gradient buffers live in shared memory,
boundary tensors go through pipes, and every process runs its ranks through the one
executor over an endpoint (``channel.ProcessChannel``), as the two other transports do.
"""
