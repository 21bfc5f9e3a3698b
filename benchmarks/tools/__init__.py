"""Developer tools: launch-shape tuners of the fused step."""
