"""What both ends of a hand-off share: the control protocol (``protocol``), the sender
(``sender``), the transfer engines (``transport``) and the typed HTTP / claim contracts.

Pure Python (no torch, no vLLM): the router imports it.
"""
