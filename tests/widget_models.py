"""Models the widget tests show, as notebook cell source (the browser tests paste them into cells; the Python tests
exec them): a torchvision-style ResNet-50 (torchvision itself is not a dependency) and the ResNet-34 of the issue
that asked for readable graphs."""

RESNET_CELL = '''
import torch, torch.nn as nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in, width, stride=1):
        super().__init__()
        c_out = width * self.expansion
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in, width, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != width:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, width, 1, stride, bias=False), nn.BatchNorm2d(width))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class TorchvisionResNet(nn.Module):
    """torchvision.models.resnet's layout and names (conv1, bn1, layer1..4, fc)."""

    def __init__(self, block, layers, num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c_in = 64
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for j in range(n):
                blocks.append(block(c_in, width, 2 if (j == 0 and i > 0) else 1))
                c_in = width * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
'''
INPUTS = "example_inputs = (torch.randn(32, 3, 224, 224),)\n"
RESNET50 = RESNET_CELL + "model = TorchvisionResNet(Bottleneck, [3, 4, 6, 3])\n" + INPUTS
RESNET34 = RESNET_CELL + "model = TorchvisionResNet(BasicBlock, [3, 4, 6, 3])\n" + INPUTS
