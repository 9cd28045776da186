import os, grpc, numpy as np
from tests.network.test_hostile_input import *  # noqa

def test_probe(live_round):
    live, d = live_round, live_round.hostile
    shares = d.send_advertise(d.advertise_request())
    for s in shares.shares:
        s.ciphertext = os.urandom(len(s.ciphertext))
    try:
        d.stub.ShareKeys(shares, timeout=30)
    except grpc.RpcError as e:
        print("sharekeys", e.code())
    print(live.honest.join(40))
    live.coordinator.wait_engine_done(40)
