"""What the module's own code around the pipelined call sees on a rank that holds only its stage: the split
Sequential's positions, and the reads that would silently train otherwise (refused before any update)."""
