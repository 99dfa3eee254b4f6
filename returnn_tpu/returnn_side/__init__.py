"""The RETURNN side: RETURNN's network inside ``tf.distribute`` replica traces.

:mod:`.returnn_bridge` (RETURNN started as ``rnn.py`` starts it, a network built inside a replica
trace), :mod:`.variable_cache` (the variables, made once and handed to every trace),
:mod:`.network_inputs` (extern data per build), :mod:`.networks` (which network an epoch trains,
RETURNN's rules for switching), :mod:`.current_network` (the network being trained and its step
functions), :mod:`.steps` (its compiled train and eval steps around ``strategy.run``),
:mod:`.replica_pass` (what one replica computes in a step).
"""
