"""Gradient plumbing: a step's gradients kept aside, summed over stages, copies and replicas, fused into nn.Linear,
deferred to W, clipped."""
