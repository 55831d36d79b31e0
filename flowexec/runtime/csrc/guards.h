// The per-call check of a captured program's guards and fed hyperparameters (flowexec/guards.py,
// flowexec/hyperparams.py), in C++: one dictionary lookup and one identity test per guard.
#pragma once

#include <c10/core/Event.h>
#include <torch/extension.h>

#include <memory>
#include <vector>

namespace flowexec {

class GuardChecker {
 public:
  // guards: (root, steps [(kind, arg)], expected, match) each; feeds: (group, key, index, device,
  // position, has_other_reads) each; hosts/devices: per device, the packed host copy (CPU float64)
  // and the buffer the program reads (the same tensor on the CPU); predicates: (feed, op, constant,
  // expected) for host reads of the form `value <op> constant`.
  // staging: per device, pinned host copies a changed value goes through to a device buffer
  // (none on the CPU, where the buffer is the host copy).
  GuardChecker(py::list guards, py::list feeds, std::vector<at::Tensor> hosts, std::vector<at::Tensor> devices,
               py::list predicates, std::vector<std::vector<at::Tensor>> staging, py::list uploaders);

  // -1: every guard holds and changed hyperparameters are in the program's buffers; >= 0: the
  // index of the first guard that fails; -2: the Python path must decide (a fed value that is no
  // number, or one a host read depends on changed).
  int check() const;
  size_t size() const { return guards_.size(); }

 private:
  struct Step {
    int kind;
    py::object arg;
  };
  struct Guard {
    py::object root;
    std::vector<Step> steps;
    py::object expected;
    int match;  // 0: identity, 1: same type and equal, 2: global state, 3: length, 4: requires_grad, 5: .grad,
                // 6: .grad is a tensor of a kind (an input of the program), 7: a tensor has no hooks of a kind
                // (flag: post accumulate grad hooks, else backward hooks), 8: the last dict item is absent,
                // 9: a dict's keys are the expected tuple's, in order
    int64_t length = 0;
    bool flag = false;
    c10::TensorImpl* impl = nullptr;  // .grad guards: the expected gradient (nullptr: None)
    std::vector<int64_t> state;      // global state: grad mode, autocast cpu/cuda + dtypes, default dtype, torch function mode stack length
    c10::Device device = c10::Device(c10::kCPU);  // .grad kind guards: the gradient's device, sizes, strides
    std::vector<int64_t> sizes, strides;
  };
  struct Feed {
    py::object group;
    py::object key;
    int index;
    int device;
    int64_t position;
    bool other_reads;
  };
  struct Predicate {
    int feed;
    int op;  // 0 ne, 1 eq, 2 gt, 3 ge, 4 lt, 5 le
    double constant;
    bool expected;
  };

  struct Ring {  // a device's pinned staging copies, used in turn, each after its last copy passed
    std::vector<at::Tensor> copies;
    std::vector<std::unique_ptr<c10::Event>> events;
    size_t next = 0;
    py::list uploader;  // non-empty once the graph writes the values itself: Python hands them over
  };

  bool holds(const Guard& g) const;
  int feeds() const;
  void upload(size_t d) const;

  std::vector<Guard> guards_;
  std::vector<Feed> feeds_;
  std::vector<at::Tensor> hosts_, devices_;
  std::vector<Predicate> predicates_;
  mutable std::vector<Ring> rings_;
};

std::vector<int64_t> global_state();

}  // namespace flowexec
