"""The speculative core, shared by both services and the wire: sampling parameters
(``params``), the sampling transform and seeded draws (``sampling``), and the exact acceptance
rule (``acceptance``). Plain torch: no FastAPI, no pydantic, no HTTP."""
