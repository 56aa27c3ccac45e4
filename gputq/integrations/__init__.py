"""Adapters at the edges: SGLang responses in, slime samples out.

They translate between the frameworks' wire and sample formats and
gputq's data model and client side; the frameworks themselves are never
imported.
"""

__all__: list[str] = []
