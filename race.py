import threading, tempfile, time, collections
from durablekv import Cache
from durablekv.errors import CacheClosedError
d = tempfile.mkdtemp()
res = collections.Counter()
for rnd in range(30):
    c = Cache(d + "/c", page_size=4, max_pages=4)
    for i in range(100): c.set(f"k{i}", b"v" * 100)
    stop = False
    def w(n):
        i = 0
        while True:
            try:
                c.set(f"k{i%100}", b"w" * 100); c.get(f"k{(i*3)%100}"); i += 1
            except CacheClosedError:
                res["closed"] += 1; return
            except Exception as e:
                res[type(e).__name__ + ": " + str(e)[:150]] += 1; return
    ts = [threading.Thread(target=w, args=(n,)) for n in range(3)]
    [t.start() for t in ts]; time.sleep(0.02); c.close(); [t.join() for t in ts]
    c = Cache(d + "/c")
    bad = [k for k in c if c.get(k) not in (b"v"*100, b"w"*100)]
    if bad or len(c) != 100: res[f"bad reopen len={len(c)} bad={bad[:3]}"] += 1
    c.close()
print(dict(res))
