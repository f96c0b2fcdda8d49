"""What crosses a stage boundary besides the hidden state: recorded values and skip connections."""
