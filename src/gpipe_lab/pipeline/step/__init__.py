"""The step: a mini-batch through every stage, whatever carries the tensors between them.

``core.PipelineCore`` owns a step (micro-batching, loss weights, schedule, the non-finite policy);
``executor`` walks each hosted rank's actions over an endpoint (``channel``; the local one in
``local_channel``) and one ``mailbox``, on long-lived ``workers``; ``pipe(x)``'s differentiable
call is ``autograd_forward``; ``clipping`` and ``nonfinite`` look at the whole pipeline's gradients.
"""
