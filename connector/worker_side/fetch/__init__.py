"""The worker's fetch path for remote chunks (KVFetcher): ``controller`` streams
them for parked requests, ``adaptive`` chooses each chunk's form,
``decode_profile`` times the forms' decodes, ``decoder_pool`` runs them."""
