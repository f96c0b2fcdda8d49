"""The pipeline without Lightning: ``StagePipeline`` and its parts (topology, transport, executor,
gradients, weight versions, block containers).
"""
