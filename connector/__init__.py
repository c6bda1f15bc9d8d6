"""kvreel's vLLM connector: tiered, exact KV offload (host -> disk).

``KVReelConnector`` is imported lazily so that the settings and tools in this
package load without importing vLLM.
"""

__all__ = ["KVReelConnector"]


def __getattr__(name):
    if name == "KVReelConnector":
        from kvreel.connector.kvreel_connector import KVReelConnector
        return KVReelConnector
    raise AttributeError(name)
