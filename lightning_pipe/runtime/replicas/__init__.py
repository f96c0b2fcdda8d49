"""What the data-parallel replicas of a stage share: FSDP2 sharding, elastic averaging, an asynchronous schedule's
pending gradients."""
