"""The Trainer's data: each stage's and replica's DataLoader, the shared sample order, reading on after a resume."""
