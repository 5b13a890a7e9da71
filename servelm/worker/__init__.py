"""The engine worker: the engine-core process (`process`), the API side's handle on it (`client`), and the typed messages between them (`messages`)."""
