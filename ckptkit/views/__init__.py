"""What people look at: text reports and machine renderings (what the CLI prints), terminal-safe
escaping of untrusted text, matplotlib plots and the ipywidgets browser. Views call operations;
nothing below imports them."""

__all__ = ["browser", "machine", "plots", "reports", "terminal"]
