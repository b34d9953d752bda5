"""`ckpt merge`: full-model merges (mergekit's methods and configs, the SD classics with block weights), streamed
band by band over any input ckpt reads. `recipe` reads the config, `methods` holds one module per method,
`sources` opens and aligns the inputs, `tensor` streams one merged tensor, `command` plans and writes."""
