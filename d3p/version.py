VERSION = "0.3.0.dev0"
