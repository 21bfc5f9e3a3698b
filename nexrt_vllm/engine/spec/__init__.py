"""Speculative decoding: the MTP head as a drafter (`mtp`) and the eager verify / accept loop (`speculative`)."""
