"""CPU kernel paths for the model's linear layers, and what each forward width costs on them."""
