"""What people look at: text reports (the CLI's renderings), matplotlib plots and the ipywidgets
browser. Views call operations; nothing below imports them."""

__all__ = ["browser", "plots", "reports"]
