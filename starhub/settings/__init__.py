"""Every process's settings, declared once (``processes``): each field's type, bounds,
default and help. The command line (``cli``), launch files (``starhub.launch.config``),
environment variables and the config a launcher hands a process (``base.load``) are all
read through them."""
