"""The imperative shell: ORT sessions, the autograd bridge and the nn.Module wrapper."""
