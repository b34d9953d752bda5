"""The layout library: the same weights under a model family's other layout's names and container
(`relayout`: original <-> diffusers for one model; `pipeline`: a diffusers pipeline folder <-> the all-in-one
file), used by `convert --layout`, `merge --layout` and `merge`'s inputs of the other layout."""
