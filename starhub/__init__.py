"""starhub: one draft hub serving many target LLM processes over ZeroMQ."""

__version__ = "0.1.0"
