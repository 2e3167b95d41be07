"""Starting and keeping processes up: the supervisor (`minibatch-serve`), warm
starts forked from a loaded model, and `minibatch-probe`."""
