import functools, jax, numpy as np, tempfile, json
from jax.sharding import NamedSharding, PartitionSpec as P
from otclr_jax import input_pipeline, train
from tests.tiny import tiny_config
d = tempfile.mkdtemp()
images = input_pipeline.load_split('digits', 'train', 8, d).images
out = {}
for name, m, ov in [('augment','simclr',{}),('ot','otclr',{}),('ot_learn','otclr',{'ot.learn_alpha': True, 'ot.beta': 1.0})]:
  c = tiny_config(d, method=m, **ov)
  mesh = train.make_mesh()
  model = train.create_model(c)
  sched = train.learning_rate_schedule(c, 2, 4)
  tx = train.create_optimizer(c, sched)
  st = jax.jit(functools.partial(train.init_state, c, model, tx), out_shardings=NamedSharding(mesh, P()))(jax.random.key(0))
  step = train.jit_train_step(c, model, tx, sched, mesh)
  batch = train.global_batch(images[:16], mesh)
  rec = []
  for _ in range(2):
    st, met = step(st, batch, jax.random.key(1))
    rec.append({k: float(np.asarray(v)).hex() for k, v in met.items() if k in ('loss','grad_norm','sinkhorn','alpha')})
  out[name] = rec
print(json.dumps(out, indent=1))
