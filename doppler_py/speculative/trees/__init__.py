"""Token trees a drafter proposes: the n-gram trie, trees ranked by a head's probabilities, and dynamic trees
grown by expected acceptance."""
